"""Drafters: where draft trees come from. All share `Drafter` (propose / commit)."""
from .base import Drafter, NoDrafter, Proposal, sample
from .draft_model import DraftModelDrafter, TreeSpec, parse_tree
from .mtp import MTPDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "DraftModelDrafter", "MTPDrafter", "NgramDrafter", "NoDrafter", "Proposal", "TreeSpec", "parse_tree",
           "sample"]
