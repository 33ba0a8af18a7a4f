from dtrain import collector

with collector.importing():  # the imports of torch, transformers and datasets (dtrain/collector.py)
    from dtrain.estimate.app import main

main()
