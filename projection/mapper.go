package projection

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/outbox"
)

// SortedSetMapper projects every record into the sorted set named
// collection: the member is the record's Key, the version its Version and
// the score its Payload, a base-10 int64 as strconv.ParseInt reads it:
// "17" or "-3" (so a bare JSON integer qualifies), and also "+17", "007"
// and "-0", each the number it spells. Any other payload (spaces, "17.0",
// "1e3") is refused with ErrInvalidPayload.
func SortedSetMapper(collection string) Mapper {
	return MapperFunc(func(rec outbox.Record) (Write, error) {
		score, err := strconv.ParseInt(string(rec.Payload), 10, 64)
		if err != nil {
			return Write{}, fmt.Errorf("%w: sorted-set score %q is not a base-10 int64", ErrInvalidPayload, truncate(rec.Payload))
		}
		return Write{
			Target:  Target{Kind: KindSortedSet, Name: collection, Member: rec.Key},
			Version: rec.Version,
			Value:   Value{Score: score},
		}, nil
	})
}

// HashMapper projects every record into the hash named collection: the
// field is the record's Key and the value its Payload, verbatim.
func HashMapper(collection string) Mapper {
	return MapperFunc(func(rec outbox.Record) (Write, error) {
		return Write{
			Target:  Target{Kind: KindHash, Name: collection, Member: rec.Key},
			Version: rec.Version,
			Value:   Value{Data: rec.Payload},
		}, nil
	})
}

// DocumentMapper projects every record into its own document whose id is
// namespace + the record's Key, holding the Payload verbatim (typically
// JSON).
//
// The id is a plain concatenation, so documents of two streams stay apart
// only while neither namespace is a prefix of the other: with "u" and
// "us", key "s1" of the first stream and key "1" of the second are both
// document "us1", and one overwrites or masks the other. Give each stream
// a namespace that no other starts with ("order:" and "invoice:", not
// "user:" and "user:settings:"); NewRedisProjector refuses a StreamMapper
// whose DocumentMappers break this rule (*ConfigError). Equal namespaces
// are allowed: they name the same documents, which is right only when both
// streams carry the same entities with one version sequence. A reconciler
// of the stream takes the same namespace (reconcile's Target.Namespace).
func DocumentMapper(namespace string) Mapper {
	return documentMapper{namespace: namespace}
}

// documentMapper is DocumentMapper's Mapper; a named type so that
// NewRedisProjector can compare the namespaces of a StreamMapper.
type documentMapper struct{ namespace string }

func (m documentMapper) Map(rec outbox.Record) (Write, error) {
	return Write{
		Target:  Target{Kind: KindDocument, Name: m.namespace + rec.Key},
		Version: rec.Version,
		Value:   Value{Data: rec.Payload},
	}, nil
}

// checkStreams refuses a StreamMapper with a nil entry (typed nils
// included, and a nested StreamMapper that routes the stream to none or
// never stops nesting), which would fail every record of its stream, and
// one two of whose streams map through DocumentMappers where one namespace
// is a proper prefix of the other (see DocumentMapper). Mappers it cannot
// see into (a MapperFunc wrapping a DocumentMapper) are not checked.
func checkStreams(m Mapper) error {
	sm, ok := m.(StreamMapper)
	if !ok {
		return nil
	}
	// Sorted, so that of several nil entries the same one is reported.
	for _, name := range slices.Sorted(maps.Keys(sm)) {
		if deps.Missing(routed(name, sm[name])) {
			return &ConfigError{Field: "mapper", Reason: fmt.Sprintf(
				"the StreamMapper's entry for stream %q is nil, or a nested StreamMapper that routes the stream to none, which would fail every record of the stream; give it a Mapper, or remove the entry", name)}
		}
	}
	type stream struct{ name, namespace string }
	var docs []stream
	for name, mm := range sm {
		if d, ok := routed(name, mm).(documentMapper); ok {
			docs = append(docs, stream{name: name, namespace: d.namespace})
		}
	}
	// Sorted, a prefix comes before every namespace it starts; ties by
	// stream name keep the reported pair deterministic.
	slices.SortFunc(docs, func(a, b stream) int {
		return cmp.Or(strings.Compare(a.namespace, b.namespace), strings.Compare(a.name, b.name))
	})
	for i, a := range docs {
		for _, b := range docs[i+1:] {
			if a.namespace != b.namespace && strings.HasPrefix(b.namespace, a.namespace) {
				rest := strings.TrimPrefix(b.namespace, a.namespace)
				return &ConfigError{Field: "mapper", Reason: fmt.Sprintf(
					"streams %q and %q use DocumentMapper namespaces %q and %q: the first is a prefix of the second, so key %q of stream %q and key \"1\" of stream %q both name document %q; choose namespaces none of which starts another",
					a.name, b.name, a.namespace, b.namespace, rest+"1", a.name, b.name, b.namespace+"1")}
			}
		}
	}
	return nil
}

// routed returns the Mapper that records of stream name reach through m,
// following nested StreamMappers (each routes by the same name): nil when
// they reach none, or when the nesting does not end (a cycle).
func routed(name string, m Mapper) Mapper {
	for range 64 {
		sm, ok := m.(StreamMapper)
		if !ok {
			return m
		}
		m = sm[name]
	}
	return nil
}

// StreamMapper routes each record to the Mapper registered for its Stream.
// A record of any other stream fails to map with ErrUnmappedStream.
type StreamMapper map[string]Mapper

// Map calls the Mapper of rec.Stream. A nil entry (typed nils included)
// counts as none.
func (m StreamMapper) Map(rec outbox.Record) (Write, error) {
	mapper, ok := m[rec.Stream]
	if !ok || deps.Missing(mapper) {
		return Write{}, fmt.Errorf("%w %q", ErrUnmappedStream, rec.Stream)
	}
	return mapper.Map(rec)
}

var _ Mapper = StreamMapper(nil)

// truncate shortens a payload for an error message.
func truncate(b []byte) string {
	const limit = 64
	if len(b) > limit {
		return string(b[:limit]) + "…"
	}
	return string(b)
}
