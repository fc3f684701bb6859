"""Runnable examples and the example models every test parallelizes."""
