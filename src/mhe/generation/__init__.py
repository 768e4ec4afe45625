"""Decoding: one session type with two policies, sampling and beam search.

* :mod:`~mhe.generation.step`: the captured step (eager, a CUDA graph, or compiled and captured),
  the one policy that picks its mode, the undo of a capture's warm-ups, the non-finite check;
* :mod:`~mhe.generation.session`: :class:`DecodeSession` (the inference view, the step mode, the
  captured steps) and its sampling policy, :class:`Generator` with the :func:`generate` loop;
* :mod:`~mhe.generation.sampling`: the token state and the choice of each token (greedy, sampled);
* :mod:`~mhe.generation.beam`: its beam policy, :class:`BeamSearcher` and :func:`beam_search`.

The models' entry points are ``DecoderForCausalLM.generate`` / ``.generator`` and
``Seq2Seq.beam_search``; they import this package when first called, so building a model loads
no decoding code (nor any Triton kernel).
"""

from mhe.generation.beam import BeamSearcher, beam_search, length_penalty
from mhe.generation.sampling import SamplingConfig
from mhe.generation.session import DecodeSession, GenerateOutput, Generator, default_session, generate, left_pad
from mhe.generation.step import STEP_MODES, StepRunner

__all__ = ["STEP_MODES", "BeamSearcher", "DecodeSession", "GenerateOutput", "Generator", "SamplingConfig",
           "StepRunner", "beam_search", "default_session", "generate", "left_pad", "length_penalty"]
