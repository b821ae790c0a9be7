"""Recv-thread scheduling: the policy rules shared with the what-if, and the live scheduler."""
