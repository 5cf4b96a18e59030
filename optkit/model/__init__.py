"""Model utilities every floor above uses: size and cost (stats), example inputs, train/eval mode and caches
(state), the data flow between submodules and the BatchNorm folding engine."""
