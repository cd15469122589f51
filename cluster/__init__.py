"""Running specdec on a real cluster: see cluster/README.md."""
