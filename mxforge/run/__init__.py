"""The whole pipeline: `mxforge run`, sequential, streamed or on Ray."""
