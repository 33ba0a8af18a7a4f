"""Programs the tests launch, each as a module from the repository root: `torchrun ... -m
tests.workers.NAME` (tests.helpers.worker)."""
