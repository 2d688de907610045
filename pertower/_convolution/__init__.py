"""The convolution rules' machinery (private), N-dimensional: geometry, the ways of
per-example filter gradients and their options, views, norms and sums of squares. The
rules that register it are in `pertower.rules` (conv2d, conv3d, depthwise_conv2d,
conv2d_transpose)."""
