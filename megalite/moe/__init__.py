"""Mixture of experts: router, token dispatch over expert-parallel ranks, grouped expert GEMMs, the layer."""
