"""Agents that ship with areal (rollout.agent: areal_cli.agents.MODULE:Name), written on
areal's agent contract (areal_cli.rollout.agents) for the tasks of AReaL's agent
examples, so that `areal import-recipe` can map AReaL's library workflows onto them."""
