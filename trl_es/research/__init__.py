"""The research's analyses of updates: sparsity and sparse deltas (`sparse`), update cosines, linear paths and KL
drift (`analysis`)."""
