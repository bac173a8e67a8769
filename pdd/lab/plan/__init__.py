"""`pdd plan`: the layouts of a GPU budget, each family's best by BCR, searched on the
simulator (`pdd.lab.sim`) after an analytic screen; the published setting (`paper`) is
its default input, a buyer's plan file its own."""
