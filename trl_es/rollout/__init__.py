"""Rollouts: how a member's completions are produced from the step's rows — plain batched generation, agent episodes
with tools and environments (`episodes`), or the user's `rollout_func`."""
