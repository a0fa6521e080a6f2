module github.com/helix-locks/helix-locks/examples/go-worker

go 1.19

require github.com/helix-locks/helix-locks/clients/go v0.0.0

replace github.com/helix-locks/helix-locks/clients/go => ../../clients/go
