"""Tuning: measure this machine, target and workload, and pick the fastest exact configuration (a Profile)."""
