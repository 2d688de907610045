"""Weights read inside loops: TF2 `While` ops and TF1 frames (see `while_v2`)."""

from pertower._loops.while_v2 import (LoopUse, Loops, concrete_uses, differentiated,
                                      output_gradients)

__all__ = ["LoopUse", "Loops", "concrete_uses", "differentiated", "output_gradients"]
