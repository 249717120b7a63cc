"""The checkers: what each engine release builds from a checkpoint (profiles, matching, modules, engine_check)
and everything validate reports (config, layout, integrity, deep checks), read-only."""
