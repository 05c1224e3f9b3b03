"""Step-time simulator (host, NumPy): the project's planner and packers on sampled batches, timed
with measured costs. ``costs``: models, calibration, kernel / collective / memory models;
``step``: the strategies and the step; ``validate``: replays of committed measurements, whose
runs ``eras`` lists by code generation and device.
Entry point: ``experiments/simulate.py``.
"""
