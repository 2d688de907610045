"""The convolution rules' shared machinery (private): geometry (padding, strides,
dilations, groups, taps, patches), the ways of per-example filter gradients, their
options, views (NCHW, SpaceToBatchND blocks, transposed convolutions), norms and sums of
squares. The op rules that use it are in `pertower.rules` (conv2d, conv3d,
depthwise_conv2d, conv2d_transpose)."""
