"""The paper's scaling figures as data and as matplotlib plots.

Figures 1 and 3: parameters of one attention sublayer against 1..128 heads with
d = 64 (Q, K, V only). Figure 4: total attention parameters of 12/24/48 layers
with 32 and 64 heads of 64 (Q, K, V only).
"""

from __future__ import annotations

from mhe.accounting.params import attention_params
from mhe.attention import KINDS, PAPER_KINDS, SPECS, attention_spec

SCALING_KINDS = ("mha", "skv", "mqa", "el-att", "mhe-mul", "sha")
LABELS = {**{k: s.display for k, s in SPECS.items()}, "mhe-mul": "MHE"}
"""Each kind's printed name (its spec's ``display``); the scaling figures show one MHE, MHE-Mul,
labelled MHE as the paper's Figures 1, 3 and 4 do."""
# One colour per kind in every plot (matplotlib's tab10, the paper's seven kinds first)
COLOURS = {k: f"tab:{c}" for k, c in zip(
    list(PAPER_KINDS) + [k for k in KINDS if k not in PAPER_KINDS],
    ("gray", "blue", "brown", "orange", "purple", "green", "red", "olive", "pink", "cyan"))}


def params_vs_heads(heads=range(1, 129), head_dim: int = 64, kinds=SCALING_KINDS) -> dict[str, list[int]]:
    """Figure 1/3 data: per-sublayer parameters (no output projection), m = n*d."""
    specs = [attention_spec(k) for k in kinds]  # each kind looked up once, not once a head count
    return {s.name: [attention_params(s, d_model=n * head_dim, n_heads=n, include_output=False) for n in heads]
            for s in specs}


def params_vs_layers(layers=(12, 24, 48), heads=(32, 64), head_dim: int = 64,
                     kinds=SCALING_KINDS) -> dict[tuple[int, int], dict[str, int]]:
    """Figure 4 data: {(layers, heads): {kind: total attention parameters}}."""
    specs = [attention_spec(k) for k in kinds]
    return {(l, n): {s.name: l * attention_params(s, d_model=n * head_dim, n_heads=n, include_output=False)
                     for s in specs}
            for n in heads for l in layers}


def plot_scaling(path: str, *, head_dim: int = 64) -> None:
    """Draw Figure 3 (left) and Figure 4 (right) into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(range(1, 129))
    curves = params_vs_heads(heads, head_dim)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for kind, ys in curves.items():
        dotted = attention_spec(kind).single_head
        ax1.plot(heads, [y / 1e6 for y in ys], label=LABELS[kind], lw=2, ls=":" if dotted else "-",
                 color=COLOURS[kind])
    ax1.set_xlabel("attention heads n")
    ax1.set_ylabel("parameters per sublayer (M)")
    ax1.set_title(f"One attention sublayer, head size d={head_dim} (Q, K, V)")
    ax1.set_yscale("log")
    ax1.grid(alpha=0.3)
    ax1.legend()

    bars = params_vs_layers(head_dim=head_dim)
    groups = list(bars)
    kinds = list(SCALING_KINDS)
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(groups))]
        ax2.bar(xs, [bars[g][kind] / 1e9 for g in groups], width, label=LABELS[kind], color=COLOURS[kind])
    ax2.set_xticks(range(len(groups)), [f"{l} layers\n{n} heads" for l, n in groups])
    ax2.set_ylabel("attention parameters (B)")
    ax2.set_title(f"All attention sublayers, d={head_dim} (Q, K, V)")
    ax2.grid(alpha=0.3, axis="y")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
