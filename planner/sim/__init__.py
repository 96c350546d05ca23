"""The discrete-event simulator: the engine's scheduler and KV manager on SimPy time."""

from planner.sim.router import ROUTERS, RouterName
from planner.sim.simulator import SimulationResult, context_length, simulate

__all__ = ["ROUTERS", "RouterName", "SimulationResult", "context_length", "simulate"]
