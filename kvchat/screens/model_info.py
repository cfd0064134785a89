"""The model info view (/model): the model's geometry, dtypes, weights, the formula's bytes
per token, the pool, and what the formula gives at the model's maximum context."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kvchat.engine.sizing import step_reads, what_if
from kvchat.engine.telemetry import CacheSnapshot
from kvchat.engine.units import human_bytes

from ..backends.protocol import BackendInfo
from ..text import inert, per_token


def rows(info: BackendInfo, snap: CacheSnapshot | None) -> list[tuple[str, str]]:
    """(what, value) pairs; unknown figures say so rather than vanish."""
    g = info.geometry
    out = [("model", info.model + ("  (random weights: the text is gibberish by design)" if info.random_weights
                                   else "")),
           ("backend", f"{info.kind} on {info.device}"),
           ("weights", info.weights or ("none: random weights" if info.random_weights else "not known")),
           ("dtypes", f"weights {info.dtype} · KV cache {info.kv_dtype}")]
    if g is not None:
        out += [("geometry", f"{g.n_layers} layers · {g.n_heads} query / {g.n_kv_heads} KV heads of {g.head_dim} · "
                             f"hidden {g.hidden} · {g.param_count() / 1e9:.2f} B parameters"),
                ("formula", f"{g.formula(info.kv_dtype)}")]
    else:
        out.append(("geometry", "not known (a server's model that matches no known geometry)"))
    if info.bytes_per_token:
        scales = snap.scale_bytes_per_token if snap is not None else 0
        out.append(("bytes per token", f"{per_token(info.bytes_per_token, scales)} "
                                       f"({human_bytes(info.bytes_per_token)})"))
    if snap is not None:
        out.append(("pool", f"{snap.num_blocks:,} blocks of {snap.block_size} tokens = "
                            f"{snap.num_blocks * snap.block_size:,} tokens"
                            + (f" · {human_bytes(snap.capacity_bytes)}" if snap.capacity_bytes is not None else "")))
    if g is not None and info.max_position:
        full = what_if(g, info.kv_dtype, info.max_position)
        line = (f"{info.max_position:,} tokens (the model's maximum) x {full.bytes_per_token:,} B"
                f"{f' + {full.scale_bytes_per_token} B of scales' if full.scale_bytes_per_token else ''} = "
                f"{human_bytes(full.bytes_needed)} for one conversation")
        if snap is not None and snap.capacity_bytes:
            line += f" ({full.bytes_needed / snap.capacity_bytes:.1f}x this pool)"
        out.append(("at full context", line))
        if info.dtype in ("fp32", "bf16", "fp16"):
            reads = step_reads(g, info.dtype, info.kv_dtype, info.max_position)
            out.append(("one decode step", f"reads the weights ({human_bytes(reads.weight_bytes)}) and the whole "
                                           f"cache; they weigh the same at {reads.crossover_tokens:,} tokens"))
    elif info.max_position is None:
        out.append(("at full context", "not known: the backend does not report the model's maximum context"))
    return out


class ModelInfoScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    ModelInfoScreen { align: center middle; }
    ModelInfoScreen > VerticalScroll {
        width: 90%; max-width: 110; height: auto; max-height: 90%; border: thick $primary; background: $surface;
        padding: 0 1;
    }
    """
    BINDINGS = [Binding("escape,q", "dismiss", "close", priority=True)]

    def __init__(self, info: BackendInfo, snap: CacheSnapshot | None) -> None:
        super().__init__()
        self.info, self.snap = info, snap

    def compose(self) -> ComposeResult:
        table = Table(title="The model and its KV cache", title_justify="left", expand=True, box=None)
        table.add_column("", style="bold", no_wrap=True)
        table.add_column("")
        for what, value in rows(self.info, self.snap):
            table.add_row(what, Text(inert(value)))   # a served model's name is the server's words
        with VerticalScroll():
            yield Static(table)
            yield Static(Text("Press escape to close.", style="dim"))

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
