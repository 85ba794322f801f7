"""`moe-pipe pull REPO[:QUANT] [--file NAME] [--dir DIR]`: a GGUF (every shard of a
split set) from the Hugging Face Hub, resumable and verified (shared/hub/client.py);
or `moe-pipe pull NAME` for a catalog entry (shared/hub/catalog.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "ref", metavar="REPO[:QUANT]", help="a Hub repository (unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M) or a catalog name (qwen3-30b-a3b)"
    )
    p.add_argument("--file", default=None, metavar="NAME", help="this GGUF of the repository (any shard of a split set) instead of a quant")
    p.add_argument(
        "--dir", default=None, metavar="DIR", help="download into DIR (default: $MOE_PIPE_MODELS or ~/.cache/moe-pipe/models/ORG--NAME/)"
    )
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (it is shown only on a terminal anyway)")


def run(args: argparse.Namespace) -> int:
    from ..shared.hub import network

    with network.quiet_retries():  # a retry is one short line, not the library's two long ones
        return _pull(args)


def _pull(args: argparse.Namespace) -> int:
    from ..shared.hub import catalog, client, store
    from ..shared.progress import byte_progress

    # A word with no "/" can only be a catalog name: a mistyped one gets the nearest names.
    entry = catalog.find(args.ref) if "/" not in args.ref else None
    if entry is None and "/" not in args.ref:
        raise client.PullError(
            f"{args.ref!r} is not a catalog name ({catalog.names_hint(args.ref)}) nor a Hub repository (ORG/NAME[:QUANT])"
        )
    repo, quant = (entry.repo, entry.quant) if entry else client.parse_ref(args.ref)
    files = client.list_files(repo, args.revision)
    sets = client.gguf_sets(files)
    chosen = client.choose(repo, sets, quant, args.file)
    if broken := client.incomplete_sets([chosen]):
        raise client.PullError(f"{repo}: the split set is incomplete on the Hub: {broken[0]}")
    dest = Path(args.dir).expanduser().resolve() if args.dir else store.repo_dir(repo)
    plan = client.download_plan(repo, args.revision, chosen, dest)
    client.check_space(plan)
    shards = f"{len(chosen.files)} files" if len(chosen.files) > 1 else "1 file"
    already = f", {sum(plan.have) / 1e9:.2f} GB already here" if sum(plan.have) else ""
    print(f"moe-pipe: pulling {repo} {chosen.quant}: {shards}, {plan.total / 1e9:.2f} GB{already} → {dest}", file=sys.stderr)
    done = sum(plan.have)
    with byte_progress(f"{chosen.quant}", enabled=sys.stderr.isatty() and not args.quiet) as update:
        update(done, plan.total)

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            update(done, plan.total)

        paths = [client.fetch_file(plan, i, on_bytes) for i in range(len(chosen.files))]
    arch = client.validate(paths[0])
    pulled = store.record(repo, chosen.quant, paths, args.revision)
    print(f"moe-pipe: pulled {repo} {chosen.quant} ({arch}, {pulled.total_bytes / 1e9:.2f} GB, sha256 verified): {paths[0]}")
    runs = [e for e in catalog.CATALOG if e.repo.lower() == repo.lower() and e.quant == chosen.quant]
    print(f"run it:  moe-pipe up {runs[0].name if runs else paths[0]}")
    return 0
