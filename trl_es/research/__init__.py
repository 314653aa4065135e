"""The research's analyses of updates: update cosines, linear paths and KL drift (`analysis`); the fitness-signal
diagnostic (`diagnose`). Update sparsity and sparse deltas are `trl_es.util.deltas` (`sparse` here is its deprecated
old path)."""
