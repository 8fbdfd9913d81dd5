"""Running model-written programs confined (Linux namespaces, a read-only system, no network, limits): the
launcher and its checks, the child that builds the confinement, the ``python`` tool's runner and the
``code_tests`` plan. A leaf: it imports nothing of training."""
