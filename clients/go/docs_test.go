package helixlocks

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// goBlocks are the ```go code blocks of a Markdown page.
func goBlocks(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	var block []string
	inside := false
	for _, line := range strings.Split(string(data), "\n") {
		switch {
		case !inside && strings.TrimSpace(line) == "```go":
			inside, block = true, nil
		case inside && strings.TrimSpace(line) == "```":
			inside = false
			blocks = append(blocks, strings.Join(block, "\n"))
		case inside:
			block = append(block, line)
		}
	}
	return blocks
}

func TestTheDocumentsGoSamplesAreCompiledHere(t *testing.T) {
	examples, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	pages := []string{"README.md", filepath.Join("..", "..", "docs", "workers.md")}
	found := 0
	for _, page := range pages {
		for _, block := range goBlocks(t, page) {
			found++
			// The body of an example: each line indented by one tab.
			lines := strings.Split(block, "\n")
			for i, line := range lines {
				if line != "" {
					lines[i] = "\t" + line
				}
			}
			if !strings.Contains(string(examples), strings.Join(lines, "\n")) {
				t.Errorf("%s: a Go sample that no example of example_test.go compiles:\n%s", page, block)
			}
		}
	}
	if found < 3 {
		t.Errorf("%d Go samples in %v", found, pages)
	}
}
