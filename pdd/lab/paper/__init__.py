"""The published comparison (`pdd sim --paper`, `sweep`, `bathtub`): the spec's claims
checked with the planner's searches (`pdd.lab.plan`) on the published setting."""
