"""Programs the tests launch, each as a module from the repository root: on N ranks by
`tests.helpers.run_worker` (forked.py: imported once, then forked), or as one process with
`python -m tests.workers.NAME` (tests.helpers.worker)."""
