// promcheck checks Prometheus rule files and PromQL expressions with Prometheus' own parser, for machines
// without promtool:
//
//	promcheck rules FILE...   the checks of `promtool check rules` (structure, PromQL, templates)
//	promcheck exprs < FILE    one PromQL expression per line (Grafana panel queries)
package main

import (
	"bufio"
	"fmt"
	"log/slog"
	"os"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: promcheck rules FILE... | promcheck exprs < FILE")
		os.Exit(2)
	}
	p := parser.NewParser(parser.Options{})
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	failed := false
	switch os.Args[1] {
	case "rules":
		for _, path := range os.Args[2:] {
			groups, errs := rulefmt.ParseFile(path, false, model.UTF8Validation, p, logger)
			for _, err := range errs {
				failed = true
				fmt.Println(err)
			}
			if len(errs) == 0 {
				rules := 0
				for _, g := range groups.Groups {
					rules += len(g.Rules)
				}
				fmt.Printf("%s: %d groups, %d rules OK\n", path, len(groups.Groups), rules)
			}
		}
	case "exprs":
		scanner := bufio.NewScanner(os.Stdin)
		count := 0
		for scanner.Scan() {
			if _, err := p.ParseExpr(scanner.Text()); err != nil {
				failed = true
				fmt.Printf("%q: %v\n", scanner.Text(), err)
			}
			count++
		}
		fmt.Printf("%d expressions parsed\n", count)
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", os.Args[1])
		os.Exit(2)
	}
	if failed {
		os.Exit(1)
	}
}
