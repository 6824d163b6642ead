"""The planner: hardware profiles, a cost model of one training step, and the layout search.

    from ultrascale.planner import get_hardware, plan, predict
    predict(model, layout, get_hardware("h100"))           # one layout: step time, MFU, breakdown
    plan(model, 64, 4 * 2**20, get_hardware("h100"))       # the ranked layouts that fit
"""

from ultrascale.planner.cost import Prediction, predict
from ultrascale.planner.hardware import PROFILES, Hardware, Link, get_hardware
from ultrascale.planner.search import Plan, PlanError, SearchSpace, enumerate_layouts, plan

__all__ = ["Hardware", "Link", "PROFILES", "Plan", "PlanError", "Prediction", "SearchSpace",
           "enumerate_layouts", "get_hardware", "plan", "predict"]
