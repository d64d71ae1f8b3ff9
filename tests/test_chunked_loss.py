"""The loss from the hidden states in chunks (training.chunked_loss, train/methods/chunked.py) against the plain path
over the full logits: the same losses, gradients and held-out sums for every method, padded and padding-free batches,
GPT-2's tied head, Llama's own, a LoRA-adapted head and the DPO reference; the fall-back for a head it does not know;
and a micro-step that never makes the host wait for the device.

Noise model (tests/conftest.py, accel_fsdp/tools/verify.py `reordered`): both paths run the same decoder on the same
batch, so their hidden states are identical; the head's products (the width's, and LOGIT_PATH bounds every logit's
path) and the sums over tokens are added in other orders. A loss or a sequence's log-probability is a sum over at
most `tokens` token terms: relative reordered(LOGIT_PATH) + reordered(tokens). A gradient element sums the products
of every token's path: relative to the largest element of its tensor, reordered(LOGIT_PATH x tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import LOGIT_PATH, collated, save_tiny_model

from accel_fsdp.config.methods import METHODS
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.batches import PADDED, PADDING_FREE
from accel_fsdp.data.store import IGNORE_INDEX, Sequence
from accel_fsdp.tools.verify import ROUNDOFF, reordered
from accel_fsdp.train.methods import LossIndex, Norm, build_loss_path, build_objective
from accel_fsdp.train.methods.chunked import CHUNKABLE, ProjectedLogps
from accel_fsdp.train.methods.logps import ChunkedPath, PlainPath
from accel_fsdp.train.probes import HostSyncs
from accel_fsdp.train.reference import NoReference

CHUNK = 5
"""Loss positions a chunk: many chunks (and vocabulary blocks in backward) over the tests' 60-odd loss tokens."""


def recipe(method: str = "sft", **training):
    options = ", ".join(f"{k}: {v}" for k, v in {"method": method, **training}.items())
    data = "builtin:quickstart-pref, format: preference" if METHODS[method].pairs else "builtin:quickstart"
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data: {{path: {data}, seq_len: 64}}
training: {{{options}}}
""", source="r.yaml")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("models")
    return {kind: AutoModelForCausalLM.from_pretrained(save_tiny_model(folder / kind, kind), dtype=torch.float32)
            for kind in ("gpt2", "llama")}


def sequences(vocab: int, *, pairs: bool, packed: bool, seed: int = 0) -> list[Sequence]:
    """Instruction-like sequences (a prompt without loss, then an answer), chosen and rejected side by side for
    pairs; `packed`: two documents in each sequence, positions restarting, the second document's first token
    without a label (as data/store.py packs)."""
    rng = np.random.default_rng(seed)
    out = []
    for length in (21, 17, 30, 12):
        ids = rng.integers(0, vocab, length)
        labels = ids.copy()
        labels[:length // 3] = IGNORE_INDEX
        positions = np.arange(length)
        if packed:
            cut = length // 2
            positions = np.concatenate([np.arange(cut), np.arange(length - cut)])
            labels[cut] = IGNORE_INDEX
        out.append(Sequence(ids, labels, positions))
    return out if pairs else out[:3]


def batch_of(model, method: str, layout: str, packed: bool = False) -> dict:
    pairs = METHODS[method].pairs
    batch = collated(sequences(model.config.vocab_size, pairs=pairs, packed=packed), 0, layout=layout)
    if method == "dpo":
        batch["reference_logps"] = -20 + torch.arange(4, dtype=torch.float32)
    return batch


def run_step(objective, model, batch) -> tuple[float, dict, dict]:
    """A micro-step's loss and gradients, and the held-out sums of the same batch."""
    model.zero_grad(set_to_none=True)
    loss, _ = objective(model, batch, Norm(tokens=40.0, pairs=2.0))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        sums = {name: float(value) for name, value in objective.evaluate(model, batch).items()}
    return float(loss.detach()), grads, sums


def assert_same(plain, chunked, tokens: int) -> None:
    (loss_a, grads_a, sums_a), (loss_b, grads_b, sums_b) = plain, chunked
    sum_tolerance = reordered(LOGIT_PATH) + reordered(tokens)
    assert loss_b == pytest.approx(loss_a, rel=sum_tolerance)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        scale = grad.abs().max().clamp(min=1e-30)
        assert float((grads_b[name] - grad).abs().max() / scale) <= reordered(LOGIT_PATH * tokens), name
    assert sums_a.keys() == sums_b.keys()
    for name, value in sums_a.items():
        assert sums_b[name] == pytest.approx(value, rel=sum_tolerance, abs=1e-12), name


LAYOUTS = [("sft", PADDED, False), ("sft", PADDED, True), ("sft", PADDING_FREE, True)] + [
    (method, layout, False) for method in ("dpo", "simpo", "orpo") for layout in (PADDED, PADDING_FREE)]
"""sft: padded rows, packed rows (documents kept apart by their positions), padding-free packed rows; the pair
methods: a pair's answers as padded rows or as the sequences of one padding-free row."""


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("method,layout,packed", LAYOUTS)
def test_the_chunked_loss_equals_the_plain_one(models, kind, method, layout, packed):
    """GPT-2's head is tied to its embedding, Llama's is its own; each method's loss, gradients and held-out sums."""
    model, r = models[kind], recipe(method, loss_chunk_tokens=CHUNK)
    batch = batch_of(model, method, layout, packed)
    chunked_path = build_loss_path(r, model)
    assert isinstance(chunked_path, ChunkedPath) and chunked_path.chunk_tokens == CHUNK
    assert batch["loss_index"].tokens > 8 * CHUNK  # many chunks
    plain = run_step(build_objective(r, NoReference(), PlainPath("for comparison")), model, batch)
    chunked = run_step(build_objective(r, NoReference(), chunked_path), model, batch)
    assert_same(plain, chunked, batch["loss_index"].tokens)


def test_the_loss_index_marks_the_positions_whose_next_token_carries_a_loss():
    vocab = 50
    for packed in (False, True):
        parts = sequences(vocab, pairs=True, packed=packed)
        for layout in (PADDED, PADDING_FREE):
            batch = collated(parts, 0, layout=layout)
            index, labels = batch["loss_index"], batch["labels"]
            width = labels.shape[1]
            expected = [(r * width + t, int(labels[r, t + 1])) for r in range(labels.shape[0])
                        for t in range(width - 1) if labels[r, t + 1] != IGNORE_INDEX]
            assert list(zip(index.positions.tolist(), index.targets.tolist())) == expected
            # each sequence's count is the label count the data stores for it (a padding-free row's sequences are
            # its documents), and its tokens are its own
            if layout == PADDED:
                pieces = [s.labels for s in parts]
            else:
                pieces = [piece for s in parts for piece in np.split(s.labels, np.flatnonzero(s.positions == 0)[1:])]
            assert index.counts.tolist() == [int((labels != IGNORE_INDEX).sum()) for labels in pieces]
            owners = index.sequences.tolist()
            assert owners == sorted(owners) and index.tokens == sum(index.counts.tolist())


@pytest.mark.parametrize("model_type", sorted(CHUNKABLE - {"gpt2", "llama"}))
def test_every_model_type_the_chunked_loss_trusts_returns_its_heads_output_as_logits(model_type):
    """The chunked loss replaces the head's output; a model type whose forward scales or caps its logits after the
    head (Gemma 2) would train on another loss. Every type in CHUNKABLE, built small from its config, gives the plain
    path's sequence log-probabilities."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    batch = collated(sequences(96, pairs=True, packed=False), 0)
    chunked = build_loss_path(recipe("dpo", loss_chunk_tokens=CHUNK), model)
    assert isinstance(chunked, ChunkedPath), chunked.describe()
    with torch.no_grad():
        plain_sums, plain_counts = PlainPath("x").sequence_logps(model, batch)
        sums, counts = chunked.sequence_logps(model, batch)
    assert torch.equal(counts, plain_counts)
    assert torch.allclose(sums, plain_sums, rtol=reordered(LOGIT_PATH) + reordered(batch["loss_index"].tokens), atol=0)


def test_a_model_whose_head_the_chunked_loss_does_not_know_runs_the_plain_path_and_says_why():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    path = build_loss_path(recipe(), AutoModelForCausalLM.from_config(config))
    assert isinstance(path, PlainPath)
    assert path.describe().startswith("  loss      full logits (the chunked loss is off: model type 'gemma2': its "
                                      "head's output is not known to reach the loss unchanged")
    off = build_loss_path(recipe(chunked_loss="false"), AutoModelForCausalLM.from_config(config))
    assert off.describe() == "  loss      full logits (training.chunked_loss: false)"


def lora_model(folder, dropout: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "lm_head"]))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # not zero, so the adapters change the output
            torch.nn.init.normal_(p, std=0.2)
    return model


def test_a_lora_adapted_head_is_projected_in_chunks_with_its_adapters_on_and_off(tmp_path):
    from accel_fsdp.train.reference import AdaptersOff

    folder = save_tiny_model(tmp_path / "llama", "llama")
    model = lora_model(folder, dropout=0.0)
    r = recipe("dpo", loss_chunk_tokens=CHUNK)
    chunked = build_loss_path(r, model)
    assert isinstance(chunked, ChunkedPath) and "LoRA-adapted head checkpointed" in chunked.describe()
    batch = batch_of(model, "dpo", PADDED)
    references = {}  # the reference: the same model with every adapter off
    for name, path in (("plain", PlainPath("x")), ("chunked", chunked)):
        reference = AdaptersOff(model, lambda: torch.autocast("cpu", enabled=False), path)
        attached = dict(batch)
        reference.attach(attached, [], "train")
        references[name] = attached["reference_logps"]
    tokens = batch["loss_index"].tokens
    assert torch.allclose(references["chunked"], references["plain"], rtol=reordered(LOGIT_PATH) + reordered(tokens))
    assert_same(run_step(build_objective(r, NoReference(), PlainPath("x")), model, batch),
                run_step(build_objective(r, NoReference(), chunked), model, batch), tokens)


def test_the_recompute_of_a_lora_head_draws_the_dropout_mask_of_its_forward(tmp_path, monkeypatch):
    """LoRA's dropout on the head: each chunk is recomputed in backward under a checkpoint that restores the RNG, so
    the gradient is the gradient of the loss the forward computed: the same as without recomputing."""
    import accel_fsdp.train.methods.chunked as chunked_module

    model = lora_model(save_tiny_model(tmp_path / "llama", "llama"), dropout=0.5)
    model.train()
    r = recipe("sft", loss_chunk_tokens=CHUNK)
    path = build_loss_path(r, model)
    batch = batch_of(model, "sft", PADDED)

    def step():
        torch.manual_seed(5)
        return run_step(build_objective(r, NoReference(), path), model, batch)[:2]

    recomputed = step()
    monkeypatch.setattr(chunked_module, "checkpoint", lambda function, *args, **kwargs: function(*args))
    kept = step()
    assert recomputed[0] == kept[0]
    for name, grad in kept[1].items():
        assert torch.equal(recomputed[1][name], grad), name


def test_in_16_bits_the_chunked_loss_rounds_as_the_plain_one(models):
    """bf16 compute (autocast over bf16 weights, as FSDP's mixed precision gathers them): both paths round the
    logits and the gradient of the logits to bf16 in the same places; the chunked one adds the hidden states'
    gradient over vocabulary blocks, each block's share rounded once (like micro-steps): verify's bf16 bound for the
    loss (2 roundoffs) and sqrt(blocks) x 2 roundoffs for the gradient norms."""
    model = models["llama"]
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.to(torch.bfloat16)
    try:
        r = recipe("dpo", loss_chunk_tokens=CHUNK)
        batch = batch_of(model, "dpo", PADDED)
        results = []
        for path in (PlainPath("x"), build_loss_path(r, model)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append(run_step(build_objective(r, NoReference(), path), model, batch))
    finally:
        model.float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(original[name])
    (loss_a, grads_a, _), (loss_b, grads_b, _) = results
    u = ROUNDOFF["bf16"]
    blocks = batch["loss_index"].tokens // CHUNK + 1
    assert loss_b == pytest.approx(loss_a, rel=2 * u)
    for name, grad in grads_a.items():
        norm_a, norm_b = float(grad.float().norm()), float(grads_b[name].float().norm())
        assert norm_b == pytest.approx(norm_a, rel=2 * u * blocks**0.5, abs=1e-30), name


TRANSFORMERS_MASK = "aten._local_scalar_dense at masking_utils.py:761 "
"""The one read-back left, transformers' own: with position ids and no attention mask (our packed rows, and
padding-free rows), `find_packed_sequence_indices` asks whether any row is packed (`(mask[:, -1] == 0).all()` in an
`if`) once per forward, for every attention kernel (masking_utils.py, _preprocess_mask_arguments; transformers
5.24). Left alone: it is the library's, and the line number pins the version it was read in."""


@pytest.mark.parametrize("method", ["sft", "dpo", "orpo"])
@pytest.mark.parametrize("layout", [PADDED, PADDING_FREE])
@pytest.mark.parametrize("chunked", [True, False])
def test_a_micro_step_never_waits_for_the_device(tmp_path, method, layout, chunked):
    """What a micro-step does once its batch is on the device (the reference's forward, the objective, backward, the
    logger's sums) asks the device for no number: HostSyncs records every call that would make the host wait for a
    GPU (an .item() or int() of a tensor, an `if` on one, a nonzero, a boolean mask, .tolist(), .cpu()). A LoRA
    model: its reference is the adapters switched off, one more forward inside the micro-step."""
    from accel_fsdp.train.observe import TrainLogger
    from accel_fsdp.train.reference import AdaptersOff

    model = lora_model(save_tiny_model(tmp_path / "llama", "llama"), dropout=0.1)
    r = recipe(method, chunked_loss=str(chunked).lower(), loss_chunk_tokens=CHUNK)
    path = build_loss_path(r, model)
    assert isinstance(path, ChunkedPath) == chunked
    reference = AdaptersOff(model, lambda: torch.autocast("cpu", enabled=False), path)
    objective = build_objective(r, reference if METHODS[method].reference else NoReference(), path)
    batch = batch_of(model, method, layout, packed=True)
    batch.pop("reference_logps", None)
    logger = dataclasses.make_dataclass("Window", ["loss", "sums"])(torch.zeros(()), {})
    with HostSyncs() as syncs:
        for _ in range(2):  # the logger's sums exist from the second micro-step on
            objective.reference.attach(batch, [], "train")
            loss, stats = objective(model, batch, Norm(tokens=40.0, pairs=2.0))
            loss.backward()
            TrainLogger.add_loss(logger, loss, stats)
    assert [call for call in syncs.calls if not call.startswith(TRANSFORMERS_MASK)] == []


def test_the_sync_counter_sees_what_would_make_a_gpu_wait():
    """The counter of the test above, shown to fail: the padding-free sequence index as it was (the number of
    sequences read back from the device) and an .item() of the loss."""
    batch = collated(sequences(50, pairs=True, packed=True), 0, layout=PADDING_FREE)
    with HostSyncs() as syncs:
        cu = batch["cu_seq_lens_q"]
        segments = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
        int(segments.max())
        torch.zeros(3).sum().item()
    assert [call.split(" at ")[0] for call in syncs.calls] == ["aten.repeat_interleave", "aten._local_scalar_dense",
                                                               "aten._local_scalar_dense"]


def test_the_projection_of_no_loss_token_is_empty_and_its_gradient_zero():
    """A micro-batch whose sequences carry no loss (a rank out of held-out units evaluates one): nothing is
    projected, and the head gets a zero gradient (the plain path's too), so every rank's FSDP backward matches."""
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    logps = ProjectedLogps.apply(hidden, weight, None, torch.zeros(0, dtype=torch.long), 4, torch.float32)
    logps.sum().backward()
    assert logps.shape == (0,) and torch.equal(weight.grad, torch.zeros_like(weight))
    assert LossIndex.of({"labels": torch.full((2, 8), IGNORE_INDEX)}).counts.tolist() == [0, 0]
