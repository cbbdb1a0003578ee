"""DeepSeek's MTP layers in transformers' terms, for the trained tiny V3.2 and V4 and for the references the runner's
drafts are checked against (tests/test_speculative.py).

transformers has no MTP module (it drops the checkpoint's layer num_hidden_layers). The layer as the hub's weights
describe it, and as vLLM and SGLang read them: at position t, eh_proj mixes [enorm(embedding of token t + 1),
hnorm(h_t)] (that order; the embedding is zero at position 0), h_t being the main model's final hidden state after
its norm; one decoder layer like the main model's (V3.2: MoE, indexed attention) runs over the mixed states with
its own attention; then shared_head.norm and the main model's head predict token t + 2. Here the decoder layer is the
one layer of a transformers DeepseekV32ForCausalLM whose final norm is shared_head.norm and whose head is the main
one (`MtpLayer.block`), so transformers' own layer computes it.

Training, the main model frozen, over random windows of the main model's training text:
- DeepSeek's MTP objective: cross-entropy of the layer's prediction at t against token t + 2;
- then distillation: KL divergence from the main model's own distribution for token t + 2 (its prediction at t + 1)
  to the layer's. A draft is accepted when it equals the target's choice, not the text's: on this tiny model the
  objective alone gave a first draft accepted 43% of the time in greedy generation (a mean acceptance length of
  1.43 at k = 1 on 4 held-out passages, 48 tokens each, in float32), the layer then distilled 1.58 on the same
  passages (docs/benchmarks.md, "MTP speculative decoding");
- then its indexer's dense warm-up, as the main layers' (tests/indexer_training.py).

DeepSeek-V4's layer (`V4MtpLayer`) trains the same way, its first two stages: it attends over its sliding window
only, with no indexer. On the same 4 passages it accepts 1.77 tokens a step at k = 1 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

MTP_ONLY = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")  # the layer's own tensors, not its block's
MTP_STEPS = 150  # the main model's schedule: AdamW, warm-up, cosine decay to a tenth
MTP_LR = 3e-3
MTP_WARMUP = 10
MTP_MIN_LR_FRACTION = 0.1
MTP_DISTILL_STEPS = 150
MTP_DISTILL_LR = 1e-3  # constant: a fine-tuning of the trained layer
MTP_INDEXER_STEPS = 60
GRAD_CLIP = 1.0


def _learning_rate(step: int) -> float:
    if step < MTP_WARMUP:
        return MTP_LR * (step + 1) / MTP_WARMUP
    progress = (step - MTP_WARMUP) / max(1, MTP_STEPS - MTP_WARMUP)
    return MTP_LR * (MTP_MIN_LR_FRACTION + (1 - MTP_MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class MtpLayer:
    enorm: nn.Module
    hnorm: nn.Module
    eh_proj: nn.Linear
    block: nn.Module  # a one-layer DeepseekV32ForCausalLM: the MTP block, shared_head.norm as its norm, the main head

    def trainable(self) -> list[nn.Parameter]:
        """Everything but the embedding and head, which are the main model's."""
        frozen = {id(self.block.lm_head.weight), id(self.block.model.embed_tokens.weight)}
        params = [*self.enorm.parameters(), *self.hnorm.parameters(), *self.eh_proj.parameters()]
        return params + [p for p in self.block.parameters() if id(p) not in frozen]

    def inputs(self, main: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> the block's input states [B, S - 1, hidden] at positions 0 .. S - 2 (the main model frozen)."""
        with torch.no_grad():
            h = main.model(input_ids=ids).last_hidden_state[:, :-1]  # after the final norm
            e = main.model.embed_tokens(ids[:, 1:]).clone()
            e[:, 0] = 0  # position 0
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))

    def logits(self, main: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> [B, S - 1, vocab]: at position t the prediction for token t + 2."""
        return self.block(inputs_embeds=self.inputs(main, ids)).logits

    def hub_weights(self, layer: int, work: Path) -> dict[str, torch.Tensor]:
        """The layer's tensors under the hub's names (model.layers.{layer}.*), its embedding and head copies the
        main model's, as DeepSeek ships them."""
        from dsconv.convert.source import open_checkpoint

        self.block.save_pretrained(work)
        saved = open_checkpoint(work)  # transformers' tensor names read as the hub's
        prefix = f"model.layers.{layer}."
        weights = {}
        for weight in saved.weights:
            name = weight.spec.name
            if name.startswith("model.layers.0."):
                weights[name.replace("model.layers.0.", prefix)] = weight.value.read()
            elif name == "model.norm.weight":
                weights[f"{prefix}shared_head.norm.weight"] = weight.value.read()
            elif name == "model.embed_tokens.weight":
                weights[f"{prefix}embed_tokens.weight"] = weight.value.read()
            elif name == "lm_head.weight":
                weights[f"{prefix}shared_head.head.weight"] = weight.value.read()
        for name, module in (("enorm", self.enorm), ("hnorm", self.hnorm), ("eh_proj", self.eh_proj)):
            weights[f"{prefix}{name}.weight"] = module.weight.detach().clone()
        return weights


def _one_layer_model(config: dict, state: dict[str, torch.Tensor], scratch: Path) -> nn.Module:
    """A one-layer checkpoint of `config` and `state` written to `scratch` and loaded back by transformers (float32),
    which converts its tensors (names, expert layouts) as it does any download's."""
    from transformers import AutoModelForCausalLM

    scratch.mkdir(parents=True)
    (scratch / "config.json").write_text(json.dumps(config))
    save_file({name: t.detach().float().clone().contiguous() for name, t in state.items()},
              scratch / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32)


def mtp_layer(main: nn.Module, source_config: dict, weights: dict[str, torch.Tensor], layer: int,
              scratch: Path) -> MtpLayer:
    """The MTP layer of hub-named `weights` (model.layers.{layer}.*; a checkpoint's, or a random fixture's to train
    from) around the main model `main` (float32): its block written to `scratch` as a one-layer transformers
    checkpoint and loaded back, so transformers converts its expert weights."""
    prefix = f"model.layers.{layer}."
    state = {name.replace(prefix, "model.layers.0."): t for name, t in weights.items()
             if name.startswith(prefix) and name.removeprefix(prefix).split(".")[0] not in MTP_ONLY}
    state.update({"model.norm.weight": weights[f"{prefix}shared_head.norm.weight"],
                  "lm_head.weight": main.lm_head.weight.detach(),
                  "model.embed_tokens.weight": main.model.embed_tokens.weight.detach()})
    config = dict(source_config)
    # one layer, an indexed MoE one as the MTP block is; transformers' config keys (layer types) as main's has them
    config.update(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["sparse"],
                  layer_types=main.config.layer_types[-1:], num_nextn_predict_layers=0)
    block = _one_layer_model(config, state, scratch)
    norm_type = type(main.model.norm)
    hidden, eps = main.config.hidden_size, main.config.rms_norm_eps
    enorm, hnorm = norm_type(hidden, eps), norm_type(hidden, eps)
    enorm.weight.data = weights[f"{prefix}enorm.weight"].float().clone()
    hnorm.weight.data = weights[f"{prefix}hnorm.weight"].float().clone()
    eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    eh_proj.weight.data = weights[f"{prefix}eh_proj.weight"].float().clone()
    return MtpLayer(enorm, hnorm, eh_proj, block)


def train_mtp(main: nn.Module, mtp, batches, dense_topk: int, log):
    """The module docstring's three stages, the main model frozen. batches(steps) yields (step, ids [B, S]);
    dense_topk: an index_topk that selects every key of them. mtp: an MtpLayer or a V4MtpLayer (whose block has
    no indexer: the third stage is skipped)."""
    from tests.indexer_training import capture_attention, indexer_parameters, set_index_topk

    main.eval()
    mtp.block.train()
    set_index_topk(mtp.block, dense_topk)  # dense: every key selected while the block trains
    optimizer = torch.optim.AdamW(mtp.trainable(), lr=MTP_LR, betas=(0.9, 0.95), weight_decay=0.0)

    def update(loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.trainable(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step, ids in batches(MTP_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step)
        logits = mtp.logits(main, ids)[:, :-1]  # positions 0 .. S - 3 predict tokens 2 .. S - 1
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
        update(loss)
        if step % 25 == 0 or step == MTP_STEPS - 1:
            log(f"MTP step {step}: loss {loss.item():.3f}")
    for group in optimizer.param_groups:
        group["lr"] = MTP_DISTILL_LR
    for step, ids in batches(MTP_DISTILL_STEPS):
        logits = mtp.logits(main, ids)[:, :-1]  # positions 0 .. S - 3: their token t + 2 is the main model's t + 1
        with torch.no_grad():
            target = main(ids).logits[:, 1:-1].log_softmax(dim=-1)
        loss = torch.nn.functional.kl_div(logits.log_softmax(dim=-1).flatten(0, 1), target.flatten(0, 1),
                                          log_target=True, reduction="batchmean")
        update(loss)
        if step % 25 == 0 or step == MTP_DISTILL_STEPS - 1:
            log(f"MTP distillation step {step}: KL {loss.item():.4f}")
    mtp.block.eval()
    if not indexer_parameters(mtp.block):  # DeepSeek-V4's MTP layer attends over its sliding window only
        return mtp
    mtp.block.set_attn_implementation("eager")
    indexer = torch.optim.AdamW(indexer_parameters(mtp.block), lr=MTP_LR, betas=(0.9, 0.95), weight_decay=0.0)
    with capture_attention(mtp.block) as captured:
        for step, ids in batches(MTP_INDEXER_STEPS):
            x = mtp.inputs(main, ids).detach()
            with torch.no_grad():
                mtp.block(inputs_embeds=x)
            loss = captured.indexer_loss(mtp.block, selected_only=False)
            loss.backward()
            indexer.step()
            indexer.zero_grad(set_to_none=True)
            if step % 25 == 0 or step == MTP_INDEXER_STEPS - 1:
                log(f"MTP indexer warm-up {step}: KL {loss.item():.4f}")
    mtp.block.eval()
    return mtp


V4_MTP_ONLY = ("e_proj", "h_proj", "enorm", "hnorm")  # mtp.0's own linears and norms (its hc_head and norm aside)


@dataclass
class V4MtpLayer:
    """DeepSeek-V4's MTP layer (`mtp.0.*`) in transformers' terms, as DeepSeek's model.py computes it: at position t,
    e_proj(enorm(embedding of token t + 1)) added to every stream of h_proj(hnorm(the main model's final streams at
    t, before hc_head)); then one decoder layer like the main model's over those streams, its own hc_head and norm,
    and the main model's head predict token t + 2. The decoder layer, hc_head and norm are those of a one-layer
    transformers DeepseekV4ForCausalLM loaded from the layer's hub tensors (`block`), run on the streams as
    DeepseekV4Model.forward runs its layers (transformers' model only takes embeddings it copies into every
    stream)."""
    enorm: nn.Module
    hnorm: nn.Module
    e_proj: nn.Linear
    h_proj: nn.Linear
    block: nn.Module

    def trainable(self) -> list[nn.Parameter]:
        """Everything but the embedding and head, which are the main model's."""
        frozen = {id(self.block.lm_head.weight), id(self.block.model.embed_tokens.weight)}
        params = [p for m in (self.enorm, self.hnorm, self.e_proj, self.h_proj) for p in m.parameters()]
        return params + [p for p in self.block.parameters() if id(p) not in frozen]

    def hub_weights(self, work: Path) -> dict[str, torch.Tensor]:
        """The layer's tensors under the hub's names (mtp.0.*; no embedding or head: V4 shares the main model's)."""
        from dsconv.convert.source import open_checkpoint

        self.block.save_pretrained(work)
        saved = open_checkpoint(work)  # transformers' tensor names read as the hub's
        weights = {}
        for weight in saved.weights:
            name = weight.spec.name
            if name.startswith("layers.0."):
                weights[name.replace("layers.0.", "mtp.0.")] = weight.value.read()
            elif name.startswith("hc_head_") or name == "norm.weight":
                weights[f"mtp.0.{name}"] = weight.value.read()
        for name in V4_MTP_ONLY:
            weights[f"mtp.0.{name}.weight"] = getattr(self, name).weight.detach().clone()
        return weights

    def inputs(self, main: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> the block's input streams [B, S - 1, hc_mult, hidden] at positions 0 .. S - 2."""
        captured = {}
        hook = main.model.hc_head.register_forward_pre_hook(lambda module, args: captured.setdefault("s", args[0]))
        try:
            with torch.no_grad():
                main.model(input_ids=ids)
                e = main.model.embed_tokens(ids[:, 1:])
        finally:
            hook.remove()
        streams = captured["s"][:, :-1]
        return self.e_proj(self.enorm(e))[:, :, None] + self.h_proj(self.hnorm(streams))

    def logits(self, main: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> [B, S - 1, vocab]: at position t the prediction for token t + 2."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        x = self.inputs(main, ids)
        model = self.block.model
        positions = torch.arange(x.shape[1])[None]
        first = x[:, :, 0]
        mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=first, attention_mask=None,
                                                 past_key_values=None, position_ids=positions)
        rope = {kind: model.rotary_emb(first, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        for layer in model.layers:
            x = layer(x, position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=ids[:, 1:],
                      past_key_values=None)
        return self.block.lm_head(model.norm(model.hc_head(x)))


def v4_mtp_layer(source_config: dict, weights: dict[str, torch.Tensor], scratch: Path) -> V4MtpLayer:
    """The MTP layer of hub-named V4 `weights` (mtp.0.*, with the main model's embed.weight and head.weight): its
    block, hc_head and norm written to `scratch` as a one-layer hub checkpoint and loaded back by transformers."""
    prefix, state = "mtp.0.", {}
    for name, t in weights.items():
        rest = name.removeprefix(prefix)
        if rest == name or rest.split(".")[0] in V4_MTP_ONLY:
            continue
        top = rest.startswith("hc_head_") or rest == "norm.weight"  # the layer's head part: the model's top level
        state[rest if top else f"layers.0.{rest}"] = t
    state.update({"embed.weight": weights["embed.weight"], "head.weight": weights["head.weight"]})
    config = dict(source_config)
    layers = config["num_hidden_layers"]
    config.update(num_hidden_layers=1, num_hash_layers=0, num_nextn_predict_layers=0,
                  compress_ratios=source_config["compress_ratios"][layers:layers + 1])
    config.pop("quantization_config", None)
    block = _one_layer_model(config, state, scratch)
    norm_type = type(block.model.norm)
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    modules = {}
    for name in ("enorm", "hnorm"):
        modules[name] = norm_type(hidden, eps)
        modules[name].weight.data = weights[f"{prefix}{name}.weight"].float().clone()
    for name in ("e_proj", "h_proj"):
        modules[name] = nn.Linear(hidden, hidden, bias=False)
        modules[name].weight.data = weights[f"{prefix}{name}.weight"].float().clone()
    return V4MtpLayer(block=block, **modules)
