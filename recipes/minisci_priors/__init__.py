"""The MiniSci priors: what builds and studies the small CPU policies `empo2` loads as `model=minisci_*`.

`prior` behaviour-clones `minisci_bc` on gold paths of MiniSci's dev variations; `prior_tips` trains `minisci_tips`
to act, act on tips and write hindsight tips; `prior_rounds` makes the shipped readers (`empo2/assets`) from it by
rounds of self-play and is the command line (`python -m recipes.minisci_priors.prior_rounds build NAME`);
`minisci_calibration` measures a prior's score, trap rate and memory effect; `research/` holds the probes behind
the choices (reports/minisci_priors). Imports `empo2` freely; nothing in `empo2` imports it.
"""
