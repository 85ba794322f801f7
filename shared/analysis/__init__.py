"""Measuring and forecasting: route-trace replay with every policy, the
`doctor` fit and forecast, `moe-pipe bench` (memory cgroups, cold runs), and the
llama.cpp peer.

Owns: offline and benchmark-time analysis; nothing here runs in a serving
process. May import: every other package of shared/.
"""
