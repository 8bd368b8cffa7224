"""Drafters: where draft trees come from. All share the core `Drafter` (start, propose, commit, skip); the
mixins `DepthControl` (adaptive speculation) and `StepState` (compiled or captured steps) are optional."""
from .base import DepthControl, Drafter, NoDrafter, Proposal, StepState, sample
from .draft_model import DraftModelDrafter, TreeSpec, parse_tree
from .eagle3 import Eagle3Drafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter
from .parallel import ParallelDrafter
from .suffix import SuffixDrafter, SuffixIndex

__all__ = ["DepthControl", "Drafter", "DraftModelDrafter", "Eagle3Drafter", "MTPDrafter", "NgramDrafter", "NoDrafter",
           "ParallelDrafter", "Proposal", "StepState", "SuffixDrafter", "SuffixIndex", "TreeSpec", "parse_tree",
           "sample"]
