"""`python -m dtrain.estimate`: per-rank memory of an experiment at any world size, planned on a CPU.

planner.py runs the trainer's own step on fake tensors (measure.py measures it), deepspeed.py puts
DeepSpeed's layouts of the same model beside it (analytic), report.py prints both.
"""
