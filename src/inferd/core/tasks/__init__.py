"""The tasks this service can serve. Two halves, one file each per task:

- the handlers (``embedding.py``, ``rerank.py``, ``classification.py``, …: torch), which tokenise and run a model;
  ``handlers.py`` says which one a model folder needs;
- the task objects (``task.py``'s ``Task``, one per task in ``*_task.py``, registered in ``kinds.py``: numpy only),
  which own what differs between tasks everywhere else: a request's task options, how two models' answers are
  compared and the bounds they are held to (the accuracy gate, the drift report), and how a result is described.
  No module outside this package branches on a task's or an output's name (tests/unit/test_task_names.py).

This file imports nothing, so the task objects load without torch (the fleet's CLI reads the drift report's
bounds) and the modules below the handlers (core/description.py, the gate) can use them without a cycle.
"""
