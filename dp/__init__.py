"""atom.dp: everything that spans ranks (process groups, per-tick sync, PrefillDelayer, DP engine loop, EP collectives, DP front end)."""
