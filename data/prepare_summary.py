"""What a preparation says about its output, from its manifest alone: the summary line, the notes and the warnings
(no stop token trained, the ChatML default, reasoning the template drops, ...). prepare_data's merge says them once;
train.py says a cached or given prepared folder's warnings again at every start (data/prepare.py), so a requeued run
whose conversations train no stop token is never silent about it. Split out of data/prepare_data.py."""

from __future__ import annotations

from data.chat_template import training_switch
from data.prepare_args import specials_note


def manifest_lines(output: str, manifest: dict) -> list[str]:
    """The lines prepare_data prints for the manifest it wrote to `output` (the summary first). A count an older
    manifest lacks (chat_docs before 2026-11-27, no_stop_rows before 2026-11-28) reads 0."""
    out: list[str] = []
    if manifest.get("eos_id") is None and manifest.get("n_docs", 0) > 1:
        out.append(f"note: no EOS appended between the {manifest.get('n_docs', 0)} pre-tokenized documents (no tokenizer, no --eos_id): "
                   "they run into each other unless their ids end with one; give --eos_id ID (the model's EOS) to separate them")
    out.append(f"{output}: {manifest.get('n_docs', 0)} documents, {manifest.get('n_tokens', 0)} tokens ({manifest.get('dtype', 0)}), {len(manifest.get('sources', []))} source(s), "
               f"{manifest.get('bad_rows', 0)} bad row(s) skipped"
               + (f", {manifest.get('empty_docs', 0)} empty or blank document(s) skipped" if manifest.get("empty_docs", 0) else "")
               + (f"; {manifest.get('chat_docs', 0)} conversations, {manifest.get('supervised_tokens', 0)} supervised tokens, "
                  f"{manifest.get('untrained_turns', 0)} assistant turn(s) not located, {manifest.get('no_stop_rows', 0)} ending with no "
                  "end-of-turn token" if manifest.get("chat_docs", 0) else "")
               + (f", {manifest.get('flagged_turns', 0)} assistant turn(s) in context with no loss, as their rows flag them (weight 0 "
                  "/ training false)" if manifest.get("flagged_turns") else "")
               + (f", {manifest.get('rewritten_arguments', 0)} with tool-call arguments rewritten to the form the template writes "
                  "(JSON text <-> object, docs/sft.md)" if manifest.get("rewritten_arguments") else ""))
    out += specials_note(manifest)
    if manifest.get("ids_given_bos"):
        out.append(f"note: {manifest.get('ids_given_bos', 0)} pre-tokenized document(s) given the tokenizer's BOS (id "
                   f"{manifest.get('bos_id', 0)}) in front, as a text document gets it")
    if manifest.get("chatml_rows") and manifest.get("chat_template", "auto") != "chatml":  # not asked for
        out.append(f"note: {manifest.get('chatml_rows', 0)} conversation(s) rendered with the ChatML default: the tokenizer has no chat "
                   "template (nor a chat_template.json beside it). Right for a base model taught ChatML; for an instruct "
                   "model, give the folder that ships its template; --chat_template none refuses such rows (docs/sft.md)")
    if manifest.get("dropped_reasoning"):
        out.append(f"warning: {manifest.get('dropped_reasoning', 0)} trained repl(ies) carry reasoning the template does not render "
                   "(it keeps only the replies' after the last user turn, as Qwen3's and gpt-oss's do at inference): those "
                   "replies train without it; one row per reply keeps every reasoning (docs/sft.md)")
    if manifest.get("history_ends"):
        out.append(f"note: {manifest.get('history_ends', 0)} end-of-turn token(s) after earlier answers not trained: the template "
                   "writes them only in the history (gpt-oss's <|end|>); a generating model ends an answer with the last "
                   "reply's (<|return|>, its stop), which is trained (docs/sft.md)")
    if manifest.get("history_ends_unknown"):
        out.append(f"warning: {manifest.get('history_ends_unknown', 0)} earlier answer(s) end with a token the template writes only "
                   "in the history (gpt-oss's <|end|>), trained: no generation_config.json beside the tokenizer says whether "
                   "generation stops on it (gpt-oss does not): give the model's folder as the tokenizer (docs/sft.md)")
    if manifest.get("appended_stops"):
        out.append(f"note: {manifest.get('appended_stops', 0)} conversation(s) end with the stop their template's history "
                   "ends a reply with, appended after the last reply and trained (GLM's <|user|>, <|observation|> after a "
                   "tool call: the next message's token, a stop of its generation config; the template writes none "
                   "after the last reply; docs/sft.md)")
    if manifest.get("no_stop_rows"):
        out.append(f"warning: {manifest.get('no_stop_rows', 0)} conversation(s) end with a reply trained with no end-of-turn token "
                   "after it (the template writes its end-of-turn only when another message follows, as Qwen1.5's "
                   "<|im_end|>): the model is never shown where to stop; end each conversation with the template's "
                   "end-of-turn (a template that writes <|im_end|> after the last message), or append it (docs/sft.md)"
                   + training_switch(manifest.get("chat_template"), (manifest.get("tokenizer") or {}).get("path")))
    return out


def manifest_warnings(output: str, manifest: dict) -> list[str]:
    """manifest_lines' warnings only (what a run reusing a prepared folder says again)."""
    return [line for line in manifest_lines(output, manifest) if line.startswith("warning:")]
