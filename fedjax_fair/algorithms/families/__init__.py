"""Pieces shared by a family of methods, apart from the one-module-per-paper factories.

``training`` (FedAvg-style local training: ``client_training`` and the local-training
arguments every such factory states), ``primal_dual`` (the primal-dual family's
augmented Lagrangian, dual ascent and server pieces: FedPD, FedADMM, FedDyn,
FedSpeed, A-FedPD), ``partial`` (partial-model personalisation: FedPer, FedRep,
LG-FedAvg), ``second_order`` (Hessians and their compression: FedNL, FedNew) and
``generative`` (synthetic sets: FedEvg, FedCVAE).
"""
