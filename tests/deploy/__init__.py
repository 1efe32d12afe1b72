"""Checks of deploy/ (kustomize tree, Dockerfile) and the autoscaler model; a package, so its conftest and
modules never shadow tests/conftest.py, which other tests import as `conftest`."""
