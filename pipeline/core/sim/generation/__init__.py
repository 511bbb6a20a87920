"""Iteration-level generation, simulated: what generating costs, the decode loop, peer LLM schedulers, scenarios, figures."""
