"""Sampling from an exported model (a Hugging Face folder or a PEFT adapter folder), to see what a fine-tune
learned: greedy by default, or temperature / top-p sampling with a seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from accel_fsdp.checkpoint.consolidate import changed_base_problem
from accel_fsdp.errors import Problem, UserError, first_line, read_json_object
from accel_fsdp.layout import EXPORT_RECORD, FINAL_DIR, dangling_link_problem
from accel_fsdp.model.build import load_pretrained
from accel_fsdp.model.checks import (damaged_json_file, model_folder_problems, not_a_model_folder, raise_problems,
                                     tokenizer_files_problem)


def resolve_model_dir(path: Path) -> Path:
    """A model folder, or a run folder (its final export)."""
    path = Path(path)
    if (dangling := dangling_link_problem(path)) is not None:
        raise UserError(dangling)
    if not path.exists():
        raise UserError(Problem(str(path), "does not exist", "give an exported model folder or a run folder"))
    for candidate in (path, path / FINAL_DIR):
        if (candidate / "config.json").exists() or (candidate / "adapter_config.json").exists():
            return candidate
    if (path / FINAL_DIR).is_dir():  # a run whose export lost files: load_model names what final/ lacks
        return path / FINAL_DIR
    raise UserError(not_a_model_folder(str(path), path))  # a checkpoint: the command that exports it


def load_model(folder: Path, device: str = "auto"):
    """The model and its tokenizer; the tokenizer first (cheap), and a UserError naming what is missing or damaged."""
    from transformers import AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(Problem("--device cuda", "no CUDA device is available", "use --device cpu (or auto)"))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    fix = ("give the run folder or a `checkpoint consolidate` export (both carry the tokenizer files), or copy "
           "tokenizer.json and tokenizer_config.json into it")
    missing = tokenizer_files_problem(folder)
    if missing:
        raise UserError(Problem(str(folder), missing, fix))
    export_again = "export the model again with `accel-fsdp checkpoint consolidate RUN OUT`"
    adapter = (folder / "adapter_config.json").exists()
    if adapter:
        config = read_json_object(folder / "adapter_config.json", what="is not a valid config", fix=export_again)
        _check_adapter_base(folder, config.get("base_model_name_or_path"))
    else:  # the reader of `recipe validate` and the launch: the same file named with the same words
        raise_problems([Problem(p.where, p.message, f"{export_again} (or {p.fix})")
                        for p in model_folder_problems(str(folder), folder)])
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError... for a folder without a tokenizer
        damaged = damaged_json_file(folder)
        raise UserError(Problem(str(folder), f"has a damaged {damaged}" if damaged else
                                f"has no usable tokenizer ({first_line(e)})", fix)) from None
    damaged = "the files are incomplete or damaged: " + export_again
    if adapter:
        try:
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except Exception as e:  # safetensors' own error type, OSError, ValueError, RuntimeError for shape mismatches
            raise UserError(Problem(str(folder), f"its weights cannot be loaded ({first_line(e, named=True)})",
                                    damaged)) from None
    else:
        model = load_pretrained(folder, dtype=dtype, where=str(folder), fix=damaged)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:  # an id past the embedding stops generate with an IndexError from torch.embedding
        raise UserError(Problem(str(folder), f"its tokenizer has {len(tokenizer)} tokens, more than the model's "
                                f"embedding of {rows} (vocab_size in config.json), so a prompt with the ids from "
                                f"{rows} on would index past it",
                                "use the tokenizer the model was trained with (checkpoint consolidate exports both), "
                                "or resize the embedding (model.resize_token_embeddings) and save the model again"))
    return model.to(device).eval(), tokenizer


def _check_adapter_base(folder: Path, base: str | None) -> None:
    """An adapter export loads over the base its adapter_config.json names: refused once that folder holds other
    weights than the adapters were trained over (checkpoint/consolidate.py `adapter_base`, in the export record)."""
    try:
        recorded = json.loads((folder / EXPORT_RECORD).read_text()).get("base")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return  # not an export of ours, or one from before the record said
    if not isinstance(recorded, dict) or recorded.get("path") != base:
        return
    problem = changed_base_problem(str(folder), recorded, "put the base back, or merge the adapter into the base it "
                                   "was trained over (`accel-fsdp checkpoint consolidate RUN OUT --merge --base-model "
                                   "PATH`) and generate from OUT/merged")
    if problem is not None:
        raise UserError(problem)


def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, chat: bool = False) -> str:
    """The continuation of `prompt` (only the new text)."""
    if chat:
        if not tokenizer.chat_template:
            raise UserError(Problem("--chat", "the tokenizer of this model has no chat template",
                                    "drop --chat to continue the prompt as plain text"))
        from jinja2 import TemplateError, TemplateSyntaxError

        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own refusal, or any error of its code
            what = ("is not valid Jinja" if isinstance(e, TemplateSyntaxError)
                    else "refuses a conversation of one user message" if isinstance(e, TemplateError)
                    else "fails on a conversation of one user message")
            detail = first_line(e, named=not isinstance(e, TemplateError))
            raise UserError(Problem("--chat", f"the chat template of this model {what}: {detail}",
                                    "drop --chat to continue the prompt as plain text, or correct the model's "
                                    "chat_template.jinja (or chat_template in tokenizer_config.json)")) from None
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    context = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    length = inputs["input_ids"].shape[1]
    if context and length + max_new_tokens > context:
        raise UserError(Problem("--max-new-tokens" if length < context else "--prompt",
                                f"the prompt ({length} tokens) and {max_new_tokens} new tokens exceed the model's "
                                f"context of {context} tokens", f"generate at most {max(0, context - length)} new "
                                "tokens" if length < context else "shorten the prompt"))
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    torch.manual_seed(seed)
    sampling = temperature > 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=sampling,
                             temperature=temperature if sampling else None, top_p=top_p if sampling else None,
                             top_k=None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
