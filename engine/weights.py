"""Loading model weights into kvchat's Llama: safetensors (memory-mapped; GGUF is converted
to safetensors first, in sources.py) or random weights of a known geometry. Pickled
checkpoints are never opened."""
from __future__ import annotations

import glob

import torch

from .arena import Arena, footprint
from .errors import ModelLoadError
from .geometry import Geometry, weight_shapes
from .model import Layer, Llama
from .sources import ModelSource


def load_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Llama:
    if src.random_weights or src.path is None:
        return random_model(src.geometry, device, dtype, seed)
    from safetensors import SafetensorError, safe_open
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(glob.glob(str(src.path / "*.safetensors")))
    try:
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{src.path}: corrupt or truncated safetensors file ({err})") from None

    shapes = weight_shapes(src.geometry)

    def take(key: str) -> torch.Tensor:
        # sources.check_weights read the same from the headers; this guards tensors changed since
        t = tensors.get(key)
        if t is None:
            raise ModelLoadError(f"{src.path}: weights lack {key}; expected a LlamaForCausalLM checkpoint")
        if tuple(t.shape) != shapes[key] or not t.is_floating_point():
            raise ModelLoadError(f"{src.path}: {key} is {t.dtype} {list(t.shape)}; config.json implies a float "
                                 f"tensor of shape {list(shapes[key])}")
        return t.to(device=device, dtype=dtype)

    return assemble(src.geometry, take, _arena(src.geometry, device, dtype))


def matrices(geom: Geometry) -> list[tuple[int, ...]]:
    """The shapes of the Llama's weight matrices as assemble() leaves them (qkv and gate/up
    fused; lm_head only where it is not the embedding)."""
    s = weight_shapes(geom)
    out = []
    for i in range(geom.n_layers):
        p = f"model.layers.{i}."
        out += [(sum(s[p + f"self_attn.{x}_proj.weight"][0] for x in "qkv"), geom.hidden),
                s[p + "self_attn.o_proj.weight"],
                (s[p + "mlp.gate_proj.weight"][0] + s[p + "mlp.up_proj.weight"][0], geom.hidden),
                s[p + "mlp.down_proj.weight"]]
    out.append(s["model.embed_tokens.weight"])
    if not geom.tie_embeddings:
        out.append(s["lm_head.weight"])
    return out


def _arena(geom: Geometry, device: torch.device, dtype: torch.dtype) -> Arena | None:
    """Where assemble() keeps the weight matrices: on the CPU, one Arena (aligned, in huge pages
    where the kernel grants them: see arena.py); elsewhere None (each tensor as it is)."""
    if device.type != "cpu":
        return None
    try:
        return Arena(footprint(matrices(geom), dtype))
    except (OSError, ValueError, TypeError, AttributeError):   # no anonymous mmap here (not Linux or macOS)
        return None


def assemble(geom: Geometry, take, arena: Arena | None = None) -> Llama:
    """Build a Llama from a `take(hf_name) -> tensor` function, fusing qkv and gate/up. arena:
    where each weight matrix is copied as it is made (the originals then dropped one by one)."""
    def keep(*parts: torch.Tensor) -> torch.Tensor:
        if arena is None:
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        out = arena.take((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), parts[0].dtype)
        return torch.cat(parts, out=out)

    layers = []
    for i in range(geom.n_layers):
        p = f"model.layers.{i}."
        wqkv = keep(take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                    take(p + "self_attn.v_proj.weight"))
        w_gate_up = keep(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
        layers.append(Layer(wqkv, keep(take(p + "self_attn.o_proj.weight")), w_gate_up,
                            keep(take(p + "mlp.down_proj.weight")),
                            take(p + "input_layernorm.weight"), take(p + "post_attention_layernorm.weight")))
    embed = keep(take("model.embed_tokens.weight"))
    lm_head = embed if geom.tie_embeddings else keep(take("lm_head.weight"))
    return Llama(geom, embed, layers, take("model.norm.weight"), lm_head)


def random_model(geom: Geometry, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Llama:
    """The geometry with N(0, 0.02) weights (norms at 1), made directly on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = weight_shapes(geom)

    def take(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, device=device, dtype=dtype)
        w = torch.empty(shape, device=device, dtype=dtype)
        return w.normal_(0.0, 0.02, generator=gen)

    return assemble(geom, take, _arena(geom, device, dtype))
