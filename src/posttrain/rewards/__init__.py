"""Scoring completions: the reward functions and their loading, the guard around user code (time, errors),
the calls in threads or worker processes, and the scorer that weighs and logs them."""
