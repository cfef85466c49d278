"""Speculation plans: which draft tokens to propose and how they form a tree."""
