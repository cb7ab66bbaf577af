"""Experiments that test the seeds' claims: length extrapolation (extrapolate.py) and what heads
do (heads.py)."""
