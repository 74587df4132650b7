//! wirespan-discovery: the discovery service, wire-compatible with the upstream
//! `sidero.discovery.server.Cluster` gRPC API, and the encrypting client library.
