"""Work built on `empo2` that the product does not import (an import-linter contract forbids it), one folder per
recipe, as verl keeps its recipes: each holds its own code, probes, benchmarks and tests, and may import anything in
`empo2`. Run from the repository root (`python -m recipes.<recipe>.<module>`)."""
