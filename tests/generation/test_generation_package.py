"""The generation package: both policies (sampling and beam search) are sessions of one type, each
with one capture cache, and the models' methods are the package's functions. (That building a
model loads none of it: ``test_import_circles``.)"""

import torch

from mhe.generation import BeamSearcher, DecodeSession, Generator
from mhe.models import build_model


def test_both_policies_are_decode_sessions_with_one_capture_cache():
    decoder = build_model("tiny-decoder", attention="mha", d_model=32, d_ff=64, n_layers=1, vocab_size=64).eval()
    seq2seq = build_model("transformer-base", attention="mha", d_model=32, d_ff=64, n_layers=1,
                          vocab_size=64).eval()
    gen, searcher = decoder.generator(1, 8), BeamSearcher(seq2seq)
    assert isinstance(gen, Generator) and isinstance(gen, DecodeSession) and isinstance(searcher, DecodeSession)
    assert (gen.policy, searcher.policy) == ("sample", "beam")
    decoder.generate(torch.randint(0, 64, (1, 3)), 2, session=gen)
    src = torch.randint(4, 64, (2, 5))
    a = seq2seq.beam_search(src, bos_id=1, eos_id=2, beam=2, max_len=6, searcher=searcher)
    assert len(gen.runners.runners) == 1 and len(searcher.runners.runners) >= 1  # captured steps, one cache each
    from mhe.generation.beam import beam_search

    assert torch.equal(a, beam_search(seq2seq, src, bos_id=1, eos_id=2, beam=2, max_len=6))  # the method is the function
