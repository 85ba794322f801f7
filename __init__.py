"""moe-pipe: Mixture-of-Experts models larger than RAM, their routed experts streamed from flash.

The checkout is the package: `procs/`, `shared/` and `cli/` import one another
relatively (`from ..shared.gguf import reader`), so code browsers, type checkers
and structure viewers follow every import from the tree as it is, and the
installed names are `moe_pipe.procs`, `moe_pipe.shared` and `moe_pipe.cli`
(no generic top-level name lands in site-packages). Imports point one way:
`shared/` < `procs/` < `cli/` (docs/architecture.md § Packages).
"""

__version__ = "0.3.0.dev0"  # the one version: pyproject.toml reads it, `--version`, /health and /v1/models show it
