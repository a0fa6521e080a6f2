module github.com/helix-locks/helix-locks/clients/go

go 1.19
