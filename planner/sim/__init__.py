"""The discrete-event simulator: the engine's scheduler and KV manager on SimPy time."""

from planner.sim.router import ROUTERS, RouterName
from planner.sim.simulator import SimulationResult, simulate

__all__ = ["ROUTERS", "RouterName", "SimulationResult", "simulate"]
