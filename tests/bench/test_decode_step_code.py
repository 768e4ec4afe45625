"""``benchmarks/decode.py step-code`` (``decoding/step_code.py``): a generated module's launches
are read in order with the source operations inductor's comment names for each, and a CPU run
of a compiled step captures inductor's code and lists one layer's launches again for a second
layer."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from decoding import step_code  # noqa: E402

CODE = '''
def helper(args):
    triton_poi_fused_not_called_0.run(x)
class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        buf0 = torch.ops.mhe.decode_key_range.default(None, arg0_1, 300, 1)
        # Topologically Sorted Source Nodes: [linear, split, view_1, k_1, cos_3, k_2], Original ATen: [aten.mm]
        stream0 = get_raw_stream(0)
        triton_poi_fused_split_with_sizes_transpose_2.run(buf5, arg1_1, buf6, 192, stream=stream0)
        # Topologically Sorted Source Nodes: [at, stack, index_copy_], Original ATen: [aten.index_copy]
        triton_poi_fused_index_copy_stack_view_4.run(arg0_1, buf8, 384, stream=stream0)
        cpp_fused_add_copy__5(arg0_1, arg0_1)
        extern_kernels.mm(reinterpret_tensor(buf1, (1, 128), (0, 1), 0), arg6_1, out=buf2)
        return (buf2, )
    triton_poi_fused_after_return_9.run(x)
'''


def test_the_launches_of_call_in_order_each_with_its_own_sources():
    """Only ``call``'s body counts, launches of every form (an operator, Triton's ``.run``, a C++
    kernel, an extern product) in order; a comment's sources belong to the next launch alone."""
    got = step_code.launches(CODE)
    assert [g["kernel"] for g in got] == [
        "torch.ops.mhe.decode_key_range.default", "triton_poi_fused_split_with_sizes_transpose_2",
        "triton_poi_fused_index_copy_stack_view_4", "cpp_fused_add_copy__5", "extern_kernels.mm"]
    assert [g["sources"] for g in got] == [
        "", "linear, split, view_1, k_1, cos_3, k_2", "at, stack, index_copy_", "", ""]


@pytest.mark.slow
def test_a_cpu_step_lists_a_layers_launches_once_a_layer(tmp_path, capsys):
    """llama-tiny's compiled step on a CPU: inductor's code is captured (kept with ``--out``),
    the step is the graph with the most launches, and a second layer adds launches, among them a
    product whose sources name the layer's operations."""
    counts = {}
    for layers in (1, 2):
        out = tmp_path / f"{layers}.json"
        assert step_code.main(["--smoke", "--kinds", "mha", "--layers", str(layers), "--context", "16",
                               "--json", str(out), "--out", str(tmp_path / f"code{layers}")]) == 0
        graphs = json.loads(out.read_text())["kinds"]["mha"]
        step = max(graphs, key=len)
        counts[layers] = len(step)
        assert any(g["kernel"] == "extern_kernels.mm" and "linear" in g["sources"] for g in step)
        assert len(list((tmp_path / f"code{layers}").glob("mha-*.py"))) == len(graphs)
    assert counts[2] > counts[1] > 0
    assert "the step (2 layers)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        step_code.main(["--smoke", "--layers", "0"])


@pytest.mark.slow
def test_the_rotating_step_shows_as_one_operator_a_layer(tmp_path):
    """``--rotary-step on``: the compiled step launches ``mhe::rotary_step`` once a layer (Triton's
    interpreter runs it on a CPU), the JSON says so, and ``kv_cache.ROTARY_STEP`` is as it was."""
    from mhe.attention import kv_cache, triton_decode

    if not triton_decode.interpreting():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 on a machine without a GPU)")
    was = kv_cache.ROTARY_STEP
    out = tmp_path / "rows.json"
    assert step_code.main(["--smoke", "--kinds", "gqa", "--layers", "2", "--context", "16", "--rotary-step", "on",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    step = max(rows["kinds"]["gqa"], key=len)
    assert rows["rotary_step"] is True and kv_cache.ROTARY_STEP is was
    assert sum(g["kernel"] == "torch.ops.mhe.rotary_step.default" for g in step) == 2
