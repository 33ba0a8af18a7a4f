"""dtrain's test suite, a package: test files and workers import `tests.helpers`. The plan is
tests/README.md."""
